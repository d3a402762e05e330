"""`python -m batchclient submit prompts.jsonl ...`: the same as `genq-batch`."""

from batchclient.cli import main

main(prog_name="genq-batch")
