"""``python -m fuzzer`` is ``fuzz``."""

from fuzzer.cli import main

main()
