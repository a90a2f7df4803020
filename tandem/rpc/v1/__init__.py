"""Generated gRPC code for package tandem.v1 (see tandem.rpc.codegen)."""
