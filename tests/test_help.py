"""Help at run time: ``help(gpuexp.Metric)``, ``Metric?`` in Jupyter and an editor's hover show each
public class's, method's and property's text. The native classes' text is their Rust doc comments
(PyO3 makes them ``__doc__``); the Python classes' is their docstrings."""

import inspect

import gpuexp
import gpuexp._core


def public_classes_and_functions():
    """gpuexp's public names, and every public class of the native module (what they return)."""
    found = {f"gpuexp.{name}": getattr(gpuexp, name) for name in gpuexp.__all__}
    for name, value in vars(gpuexp._core).items():
        if isinstance(value, type) and not name.startswith("_"):
            found.setdefault(f"gpuexp._core.{name}", value)
    return found


def public_members(cls):
    """The public methods and properties a class defines or inherits from gpuexp's classes."""
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        for name in vars(klass):
            if not name.startswith("_"):
                yield name, inspect.getattr_static(klass, name)


def test_the_public_api_is_what_this_test_walks():
    found = public_classes_and_functions()
    assert {"gpuexp.Metric", "gpuexp.GpuReport", "gpuexp.Report", "gpuexp.GPUExperiment", "gpuexp.compare",
            "gpuexp._core.Holders", "gpuexp._core.BatchSizeResult"} <= set(found)
    members = dict(public_members(gpuexp.Report))
    assert {"host", "gpus", "notes", "to_dict", "to_json", "diff", "plot"} <= set(members)
    assert {"start", "peak", "reclaimed_share"} <= dict(public_members(gpuexp.Metric)).keys()


def test_every_public_class_method_and_property_has_its_text_at_run_time():
    missing = []
    for label, value in public_classes_and_functions().items():
        if not (value.__doc__ or "").strip():
            missing.append(label)
        if isinstance(value, type):
            for name, member in public_members(value):
                doc = member.__func__.__doc__ if isinstance(member, (staticmethod, classmethod)) else member.__doc__
                if not (doc or "").strip():
                    missing.append(f"{label}.{name}")
    assert not missing, (
        f"no help text at run time for {missing}: a native one's is its `///` doc comment in "
        "rust/src/bindings/ (a field's for get_all classes), a Python one's its docstring"
    )


def test_help_shows_a_native_class_s_text():
    text = inspect.getdoc(gpuexp.Metric)
    assert text and "in bytes" in text
    assert "before_teardown - start" in (gpuexp.Metric.consumed.__doc__ or "")
