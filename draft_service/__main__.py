"""python -m draft_service [--config FILE] [--port N] [--engine E] [--model M] ..."""
from specdec.cli import service_main

if __name__ == "__main__":
    service_main("draft")
