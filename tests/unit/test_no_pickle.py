"""Nothing on the data plane is unpickled: trajectories are msgpack of plain types, weight metadata
JSON, tensors raw bytes. A stray pickle/cloudpickle/torch.load(weights_only=False)/numpy
allow_pickle in the packages that read network input would let anyone who reaches a socket run code."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA_PLANE = ("buffer", "actors", "weightsync")
UNSAFE = re.compile(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill)\b|pickle\.loads?\(|weights_only\s*=\s*False"
                    r"|allow_pickle\s*=\s*True|VLLM_ALLOW_INSECURE_SERIALIZATION\"?\]?\s*=|setdefault\(\s*.VLLM_ALLOW_INSECURE",
                    re.M)


def test_no_unpickling_on_the_data_plane():
    files = [p for pkg in DATA_PLANE for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 10
    hits = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in files for m in UNSAFE.finditer(p.read_text())]
    assert not hits, hits


def test_the_rule_catches_what_it_is_for():
    for bad in ("import pickle\n", "from cloudpickle import loads\n", "x = pickle.loads(b)\n",
                "torch.load(f, weights_only=False)\n", "np.load(f, allow_pickle=True)\n",
                'os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"\n',
                'os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")\n'):
        assert UNSAFE.search(bad), bad
    assert not UNSAFE.search("msgpack.unpackb(data, raw=False)\n")


PRODUCT = ("actors", "buffer", "cluster", "data", "engines", "learner", "rewards", "runbase", "weightsync", "experiments")
TORCH_LOAD = re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)[^)]*\)")


def test_every_torch_load_in_the_product_refuses_pickled_objects():
    """A checkpoint folder is a file system others may write to: torch.load reads only tensors there
    (weights_only=True), anywhere in the product, not only on the data plane."""
    files = [p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files for m in TORCH_LOAD.finditer(p.read_text())]
    assert not hits, hits
    assert any("torch.load(" in p.read_text() for p in files)  # the rule has something to judge
    assert TORCH_LOAD.search("torch.load(path)") and not TORCH_LOAD.search("torch.load(path, weights_only=True)")
