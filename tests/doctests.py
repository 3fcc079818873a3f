"""The docstring examples of the omnihvd package, found and run as tests.

Examples run in the ``unit`` tier (test_doctests.py) unless listed in
:data:`NEEDS_INSTALL`, which ``test_doctests_single.py`` runs with the installed stack.
A new module's examples are therefore unit tests by default; if they need torch,
Horovod or the install, add the module (or the one docstring) here.
"""
import copy
import doctest
import importlib
import io
import os
import pkgutil

import omnihvd

# Module names, or "module.qualname" of one docstring, whose examples need torch,
# Horovod or a complete install (a module listed here is not even imported by the
# unit tier).
NEEDS_INSTALL = (
    "omnihvd.tools.models",                     # torch at import
    "omnihvd.sampler",                          # torch at import
    "omnihvd.normalization.batchnorm_layers",   # a torch model
    "omnihvd.weighting.register_gradient_weight",  # a torch tensor hook
    "omnihvd.weighting.weighted_parameters",     # a torch model and optimizer
    "omnihvd.tools.doctor.run_checks",          # runs the doctor on this install
    "omnihvd.elastic",                          # horovod.torch at import (a TorchState subclass)
)


def _listed(name):
    return any(name == entry or name.startswith(entry + ".") for entry in NEEDS_INSTALL)


def module_names():
    """Every module of the package, in a stable order."""
    root = os.path.dirname(omnihvd.__file__)
    names = ["omnihvd"] + [m.name for m in pkgutil.walk_packages([root], "omnihvd.")]
    return sorted(names)


def examples(needs_install):
    """The doctests with examples, of the tier asked for: ``{name: DocTest}``."""
    found = {}
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in module_names():
        if not needs_install and _listed(name):
            continue  # do not import it: it may need torch
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            if test.examples and _listed(test.name) == needs_install:
                found[test.name] = test
    return found


def run(test):
    """Run one DocTest; returns (failures, report)."""
    test = copy.copy(test)
    test.globs = dict(test.globs)  # each run starts from the module's own globals
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test, out=out.write, clear_globs=True)
    return runner.failures, out.getvalue()
