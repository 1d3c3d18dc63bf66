import pytest
import torch

from flashserve.model.loader import load_model

torch.set_num_threads(1)  # tiny models: thread wake-ups cost more than they give on a shared machine


@pytest.fixture(scope="session")
def models():
    cache = {}

    def get(name: str, dtype=torch.float64, with_mtp: bool = False):
        key = (name, dtype, with_mtp)
        if key not in cache:
            cache[key] = load_model(name, dtype=dtype, with_mtp=with_mtp)
        return cache[key]

    return get
