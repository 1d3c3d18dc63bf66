"""Tensor, expert and attention-data parallelism over ``torch.distributed``: the sharded engine
(:mod:`.executor`), the weights' split (:mod:`.shard`), the collectives (:mod:`.comm`). The rank layout is
:mod:`flashserve.config.ranks`; what decides between one process and shards is
:func:`flashserve.entrypoints.engines.create_engine`."""
