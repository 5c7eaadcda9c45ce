"""`python -m tinyvllm` = the `tinyvllm` command."""

from tinyvllm.cli import main

main(prog_name="tinyvllm")
