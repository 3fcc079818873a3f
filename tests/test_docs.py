"""README.rst and docs/: the options table is complete, the drop-in example is the whole
loop, and every page is reachable. Read as text, so they stay true as options and
pages are added."""
import ast
import os
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit


def read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def callback_parameters():
    """OmniLearnCallback.__init__'s parameters, from the source (no torch needed)."""
    tree = ast.parse(read("omnihvd", "callback.py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OmniLearnCallback")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    return [a.arg for a in args.args[1:] + args.kwonlyargs]


def readme_options():
    text = read("README.rst")
    section = text.split("\nOptions\n-------\n", 1)[1].split("\nDocumentation\n", 1)[0]
    return re.findall(r"^``(\w+)``\s", section, flags=re.M)


def test_readme_options_table_lists_every_callback_keyword_in_order():
    params = callback_parameters()
    assert "abort_on_exception" in params and "global_batch_size" in params
    assert readme_options() == params


def test_drop_in_examples_run_the_whole_loop():
    loop = ["hvd.init()", "hvd.DistributedOptimizer(", "omnihvd.OmniLearnCallback(",
            "omnihvd.HeterogeneousBatchSampler(", "cb.on_train_begin()", "sampler.set_epoch(epoch)",
            "cb.on_epoch_begin(epoch)", "cb.on_batch_begin()", "cb.on_batch_end()",
            "cb.on_epoch_end(epoch)", "cb.on_train_end()"]
    readme = read("README.rst").split("\n.. code-block:: python\n", 1)[1].split("\n\n``", 1)[0]
    tree = ast.parse(read("omnihvd", "callback.py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OmniLearnCallback")
    docstring = ast.get_docstring(cls).split("Example::", 1)[1]
    for name, text in (("README.rst", readme), ("OmniLearnCallback's docstring", docstring)):
        positions = [text.find(line) for line in loop]
        assert all(p >= 0 for p in positions), (name, [l for l, p in zip(loop, positions) if p < 0])
        assert positions == sorted(positions), name
        # on_train_end closes the loop: outside the epoch loop, at the loop's own indent
        assert re.search(r"^( *)for epoch in .*\n(?:\1 .*\n|\n)*\1cb\.on_train_end\(\)", text,
                         flags=re.M), name


def test_every_docs_page_is_listed_in_the_index_and_readme_links_exist():
    pages = sorted(p for p in os.listdir(os.path.join(ROOT, "docs"))
                   if p.endswith(".rst") and p != "index.rst")
    index = read("docs", "index.rst")
    assert [p for p in pages if "<%s>`_" % p not in index] == []
    for link in re.findall(r"<([^<>]+\.rst)>`_", read("README.rst")):
        assert os.path.exists(os.path.join(ROOT, link)), link
