"""omnihvd.tools.data: the Fashion-MNIST IDX reader, on the installed files and on small
synthetic IDX files (gzipped and plain), and its error messages."""
import gzip
import os
import struct

import numpy as np
import pytest

from omnihvd.tools import data
from omnihvd.tools.data import DatasetNotFoundError, load_fashion_mnist, read_idx
from omnihvd.errors import OmniHvdError

pytestmark = pytest.mark.single


def write_idx(path, array, compress=True, dtype_code=0x08, truncate=0):
    array = np.asarray(array, dtype=np.uint8)
    raw = bytes([0, 0, dtype_code, array.ndim]) + struct.pack(">%dI" % array.ndim, *array.shape)
    raw += array.tobytes()
    raw = raw[:len(raw) - truncate]
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(raw)


def fake_dataset(folder, compress=True, n_train=100, n_test=10000):
    """Writes all four files; images hold the example's index modulo 256, labels index % 10."""
    os.makedirs(folder, exist_ok=True)
    suffix = ".gz" if compress else ""
    for stem, n in [("train", n_train), ("t10k", n_test)]:
        images = (np.arange(n, dtype=np.int64) % 256).astype(np.uint8)[:, None, None] * \
            np.ones((1, 28, 28), dtype=np.uint8)
        write_idx(os.path.join(folder, "%s-images-idx3-ubyte%s" % (stem, suffix)), images, compress)
        write_idx(os.path.join(folder, "%s-labels-idx1-ubyte%s" % (stem, suffix)),
                  np.arange(n) % 10, compress)


def test_installed_fashion_mnist():
    """The Debian package's files (tools/setup.sh installs dataset-fashion-mnist)."""
    x, y = load_fashion_mnist("train")
    assert x.shape == (60000, 1, 28, 28) and str(x.dtype) == "torch.float32"
    assert y.shape == (60000,) and str(y.dtype) == "torch.int64"
    assert set(y.unique().tolist()) == set(range(10))
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01   # normalised
    tx, ty = load_fashion_mnist("test", limit=100)
    assert tx.shape == (100, 1, 28, 28) and len(ty) == 100
    assert len(data.fashion_mnist("test")) == 10000


@pytest.mark.parametrize("compress", [True, False])
def test_synthetic_idx_through_env_var(tmp_path, monkeypatch, compress):
    fake_dataset(str(tmp_path), compress, n_test=10000)
    monkeypatch.setenv("OMNIHVD_DATA", str(tmp_path))
    assert data.data_root() == str(tmp_path)
    x, y = load_fashion_mnist("test", limit=300)
    assert y.tolist() == [k % 10 for k in range(300)]
    pixels = (x[:, 0, 5, 5] * data.STD + data.MEAN) * 255
    assert np.allclose(pixels.numpy(), np.arange(300) % 256, atol=1e-3)


def test_explicit_root_beats_env(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIHVD_DATA", "/nonexistent")
    assert data.data_root(str(tmp_path)) == str(tmp_path)
    monkeypatch.delenv("OMNIHVD_DATA")
    assert data.data_root() == data.DEFAULT_ROOT


def test_missing_files_say_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIHVD_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DatasetNotFoundError) as info:
        load_fashion_mnist("train")
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message and "OMNIHVD_DATA" in message
    assert "train-images-idx3-ubyte" in message and isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(truncate=5), "truncated or corrupt"),
    (dict(dtype_code=0x0D), "only 0x08"),
])
def test_corrupt_files(tmp_path, kwargs, fragment):
    path = str(tmp_path / "x.gz")
    write_idx(path, np.zeros((3, 2, 2)), **kwargs)
    with pytest.raises(DatasetNotFoundError, match=fragment):
        read_idx(path)


def test_not_idx_and_not_gzip(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"hello world")
    with pytest.raises(DatasetNotFoundError, match="bad magic"):
        read_idx(str(path))
    bad_gz = tmp_path / "junk.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetNotFoundError, match="cannot read"):
        read_idx(str(bad_gz))


def test_wrong_shape_is_reported(tmp_path):
    fake_dataset(str(tmp_path), n_test=50)
    with pytest.raises(DatasetNotFoundError, match=r"expected \(10000, 28, 28\)"):
        load_fashion_mnist("test", root=str(tmp_path))


@pytest.mark.parametrize("kwargs", [dict(split="validation"), dict(limit=0), dict(limit=2.5),
                                    dict(limit=True)])
def test_bad_arguments(kwargs):
    with pytest.raises(OmniHvdError):
        load_fashion_mnist(**kwargs)
