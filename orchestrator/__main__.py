"""python -m orchestrator [--config FILE] [--port N] [--target-address A] [--draft-address A] ..."""
from specdec.cli import service_main

if __name__ == "__main__":
    service_main("orchestrator")
