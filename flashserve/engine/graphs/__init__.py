"""How a decode step runs fast: the fixed-shape step and its buckets (:mod:`.decode_step`), its compiled regions
called directly (:mod:`.regions`), CUDA-graph replay (:mod:`.graph_call`) and inductor's graph passes
(:mod:`.inductor_passes`)."""
