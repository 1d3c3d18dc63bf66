"""How a decode step runs fast: the fixed-shape step and its buckets (:mod:`.decode_step`), direct calls of
dynamo's graphs and CUDA-graph replay (:mod:`.graph_call`), the weights as one buffer per dtype
(:mod:`.weight_arena`) and inductor's graph passes (:mod:`.inductor_passes`)."""
