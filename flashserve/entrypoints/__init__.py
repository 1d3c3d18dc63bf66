"""What users start: :class:`~.llm.LLM` (offline generation), :func:`~.engines.create_engine` (one process or
shards, decided from the configuration) and the ``generate`` command. Above both :mod:`flashserve.engine` and
:mod:`flashserve.parallel`, which never import it."""
