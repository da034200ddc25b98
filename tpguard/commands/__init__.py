"""CLI command implementations; tpguard/cli.py wires them into one typer app."""
