"""The measurement lab: `specdec bench`, `specdec study` and `specdec tune`, and what they share.

Nothing in the core (specdec/*.py) or the services imports the lab (tests/test_imports.py checks
it); the lab uses the core. Modules, bottom up (each imports only those above it):

- workloads: prompt workloads from shipped data (ShareGPT, HumanEval), rendered for a tokenizer;
- analysis: pure statistics over measured requests (spread, E(k), ideal bound, time split...);
- peers: the baselines (transformers generate / assisted generation, llama.cpp speculative);
- live: the live stack (our services on free ports, draft variants and swaps, /metrics);
- report: Markdown reports, plots and study.json;
- bench, study, tune: the three commands; cli: their argument parsers.

matplotlib and tqdm come with the optional extra `lab` (`pip install -e ".[lab]"`) and are
imported only where a plot is drawn or a progress bar shown.
"""
