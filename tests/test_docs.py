"""README.rst and docs/: the options tables are complete, the README's loop calls no
omnihvd, the callback's example is the whole loop, and every page is reachable. Read as text, so they stay true as options and
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


def init_parameters(module, name):
    """``name.__init__``'s parameters in ``omnihvd/<module>.py``, from the source."""
    tree = ast.parse(read("omnihvd", module + ".py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    return [a.arg for a in args.args[1:] + args.kwonlyargs]


def options_table(*path):
    section = read(*path).split("\nOptions\n-------\n", 1)[1]
    section = section.split("\n====", 2)[1]   # the table, from its first rule on
    return re.findall(r"^``(\w+)``\s", section.split("\n\n", 1)[0], flags=re.M)


def test_options_tables_list_every_keyword_in_order():
    balancer = init_parameters("balancer", "Balancer")
    assert "advanced" in balancer and len(balancer) <= 10
    assert options_table("README.rst") == balancer
    callback = init_parameters("callback", "OmniLearnCallback")
    assert "abort_on_exception" in callback and "global_batch_size" in callback
    assert options_table("docs", "callback.rst") == callback


def first_code_block(*path):
    return read(*path).split("\n.. code-block:: python\n", 1)[1].split("\n\n``", 1)[0]


def test_the_readme_loop_calls_nothing_of_omnihvd():
    text = first_code_block("README.rst")
    setup, loop = text.split("for epoch in", 1)
    for line in ("hvd.init()", "hvd.DistributedOptimizer(", "omnihvd.Balancer(", "bal.loader("):
        assert line in setup, line
    assert "loader.sampler.set_epoch(epoch)" in loop and "opt.step()" in loop
    assert "omnihvd" not in loop and "bal." not in loop and "cb." not in loop


def test_the_callback_examples_run_the_whole_loop():
    loop = ["hvd.init()", "hvd.DistributedOptimizer(", "omnihvd.OmniLearnCallback(",
            "omnihvd.HeterogeneousBatchSampler(", "cb.on_train_begin()", "sampler.set_epoch(epoch)",
            "cb.on_epoch_begin(epoch)", "cb.on_batch_begin()", "cb.on_batch_end()",
            "cb.on_epoch_end(epoch)", "cb.on_train_end()"]
    tree = ast.parse(read("omnihvd", "callback.py"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OmniLearnCallback")
    docstring = ast.get_docstring(cls).split("Example::", 1)[1]
    for name, text in (("docs/callback.rst", first_code_block("docs", "callback.rst")),
                       ("OmniLearnCallback's docstring", docstring)):
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
