# Thin aliases over ./dev, which works without make.
.PHONY: up test bench-engine typecheck
up:
	./dev up
test:
	./dev test
bench-engine:
	.venv/bin/python bench/engine.py
typecheck:
	.venv/bin/mypy tandem
