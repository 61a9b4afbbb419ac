"""The run's options: one typed config tree, from which the command line, the YAML run files,
``--help``, ``docs/flags.md`` and the Megatron-LM spellings are all derived.

* ``option.py``: how an option is declared (one field of a frozen section dataclass);
* one module per component's section: ``model``, ``training`` (with parallelism), ``grpo``,
  ``rollouts`` (with the inference engine and server), ``evaluation``, ``output`` (checkpoints
  and logging);
* ``run.py``: ``RunConfig``, the sections together with what start-up derives, and the checks
  across sections;
* ``parse.py``: the parser derived from the sections and ``parse_args``; ``command_line.py``,
  ``megatron_lm.py`` and ``megatron_lm_common.py``: Megatron-LM's command lines in one pass;
  ``run_file.py``: ``--config`` YAML files and the resolved config a run writes;
  ``markdown.py``: ``docs/flags.md``.

Nothing here imports torch or megatron-core at module level: ``--help`` takes well under a second.
"""
