"""The main job, ``hopq train``: data-parallel training with hopq's DDP hook on an
emulated cluster network, one run per contender, and its report.

* :mod:`.job`: the options, the per-rank training loop and the run of every contender;
* :mod:`.workloads`: the models with their data (a byte-level GPT, MiniLM fine-tuning);
* :mod:`.models`, :mod:`.data`: the GPT and the standard-library text;
* :mod:`.report`: the report (tables, ratios to a baseline and plots).
"""
