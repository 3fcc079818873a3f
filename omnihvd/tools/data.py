"""Fashion-MNIST from its IDX files, as torch tensors, for the benchmarks and examples.

The four gzipped IDX files (``train-images-idx3-ubyte.gz`` and friends) come from
Debian's ``dataset-fashion-mnist`` package, which installs them in
``/usr/share/datasets/fashion-mnist``. Set ``OMNIHVD_DATA`` to read them from another
folder (e.g. a shared file system on a cluster). Nothing is downloaded.

The IDX format (LeCun et al.) is a big-endian header: two zero bytes, a type code
(``0x08`` = unsigned byte), the number of dimensions, then one 32-bit size per
dimension, followed by the data in C order.
"""
import gzip
import os
import struct
from typing import Optional, Tuple

import numpy as np

from ..errors import OmniHvdError

__all__ = [
    "DEFAULT_ROOT", "ENV_VAR", "CLASSES", "MEAN", "STD",
    "DatasetNotFoundError", "data_root", "read_idx", "load_fashion_mnist", "fashion_mnist",
]

DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
ENV_VAR = "OMNIHVD_DATA"
# Pixel mean and standard deviation of the training images (scaled to [0, 1]).
MEAN = 0.2860
STD = 0.3530
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10000),
}


class DatasetNotFoundError(OmniHvdError):
    """The dataset files are missing or unreadable; the message says how to install them."""


def data_root(root: Optional[str] = None) -> str:
    """The folder holding the IDX files: ``root``, else ``$OMNIHVD_DATA``, else the default.

    >>> data_root("/data/fmnist")
    '/data/fmnist'
    """
    return root or os.environ.get(ENV_VAR) or DEFAULT_ROOT


def _find(root: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        path = os.path.join(root, name)
        if os.path.isfile(path):
            return path
    raise DatasetNotFoundError(
        "Fashion-MNIST file %s(.gz) not found in %s. Fix: `apt-get install "
        "dataset-fashion-mnist` (Debian/Ubuntu; `bash tools/setup.sh` does it), or set "
        "%s to a folder holding the four IDX files." % (stem, root, ENV_VAR))


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (gzipped or not) of unsigned bytes into a numpy array.

    Args:
        path: the file.

    Returns:
        ``uint8`` array with the shape the header declares.

    Raises:
        DatasetNotFoundError: the file is missing, not IDX, not ``uint8``, or truncated.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise DatasetNotFoundError("cannot read %s: %s. Fix: reinstall it "
                                   "(apt-get install --reinstall dataset-fashion-mnist)" % (path, exc))
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetNotFoundError("%s is not an IDX file (bad magic number); fix: reinstall "
                                   "dataset-fashion-mnist or point %s elsewhere" % (path, ENV_VAR))
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code != 0x08:
        raise DatasetNotFoundError("%s holds IDX type 0x%02x; only 0x08 (unsigned byte) is "
                                   "supported" % (path, dtype_code))
    header = 4 + 4 * ndim
    shape = struct.unpack(">%dI" % ndim, raw[4:header])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count:
        raise DatasetNotFoundError("%s is truncated or corrupt: header says %s (%d bytes), file "
                                   "holds %d; fix: reinstall dataset-fashion-mnist"
                                   % (path, shape, count, len(raw) - header))
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_fashion_mnist(split: str = "train", root: Optional[str] = None,
                       limit: Optional[int] = None) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """Images and labels of one split as tensors.

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000).
        root: folder of the IDX files (default: see :func:`data_root`).
        limit: keep only the first ``limit`` examples (for quick tests).

    Returns:
        ``(images, labels)``: float32 ``(N, 1, 28, 28)`` normalised with :data:`MEAN`
        and :data:`STD`, and int64 ``(N,)`` class indices in 0..9.

    Raises:
        DatasetNotFoundError: the files are missing or corrupt (the message says how
            to install them).
        OmniHvdError: a bad ``split`` or ``limit``.

    >>> x, y = load_fashion_mnist("test", limit=8)   # doctest: +SKIP
    >>> x.shape, y.shape                              # doctest: +SKIP
    (torch.Size([8, 1, 28, 28]), torch.Size([8]))
    """
    import torch

    if split not in _FILES:
        raise OmniHvdError("split must be 'train' or 'test', got %r" % (split,))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise OmniHvdError("limit must be a positive int or None, got %r" % (limit,))
    folder = data_root(root)
    image_stem, label_stem, expected = _FILES[split]
    images = read_idx(_find(folder, image_stem))
    labels = read_idx(_find(folder, label_stem))
    if images.shape != (expected, 28, 28) or labels.shape != (expected,):
        raise DatasetNotFoundError("%s split in %s has images %s and labels %s; expected "
                                   "(%d, 28, 28) and (%d,)" % (split, folder, images.shape,
                                                               labels.shape, expected, expected))
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / 255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def fashion_mnist(split: str = "train", root: Optional[str] = None, limit: Optional[int] = None):
    """The split as a ``torch.utils.data.TensorDataset`` of ``(image, label)`` pairs.

    Arguments, return and errors as in :func:`load_fashion_mnist`.

    >>> ds = fashion_mnist("train")     # doctest: +SKIP
    >>> len(ds)                         # doctest: +SKIP
    60000
    """
    from torch.utils.data import TensorDataset

    return TensorDataset(*load_fashion_mnist(split, root, limit))
