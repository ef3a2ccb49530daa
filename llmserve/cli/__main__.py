"""`python -m llmserve.cli`: how `up`, `worker --tp N` and the offline `LLM` start worker
processes (worker.py's `worker_args`), and the entry point wherever no `llmserve` script is
installed."""

from llmserve.cli import main

if __name__ == "__main__":  # an import (a tool walking the package) must not run the command
    main()
