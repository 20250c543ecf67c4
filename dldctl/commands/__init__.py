"""The `dldctl` subcommands, one module per group: thin Typer functions that parse, call a room below, print."""
