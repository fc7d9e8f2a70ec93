"""python -m target_service [--config FILE] [--port N] [--model M] ..."""
from specdec.cli import service_main

if __name__ == "__main__":
    service_main("target")
