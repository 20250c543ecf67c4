"""`python -m dldctl` is the same as the `dldctl` console script."""

from dldctl.cli import main

main()
