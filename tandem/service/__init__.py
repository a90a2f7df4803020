"""What every Tandem process shares: flags with TANDEM_* twins, the event loop, logging."""
