"""A thin layer over the parts of Polygraphy's API that changed between 0.49 and 0.53.

* ``Comparator.compare_accuracy`` returns an ``AccuracyResult`` (an ordered dict ``(runner0, runner1) ->
  [per-iteration {output -> OutputCompareResult}]``) in 0.49/0.50, but an ``AccuracyResults`` list (one
  ``AccuracyResult`` per compare function) from 0.53.4: :func:`first_accuracy_result`.
* ``SimpleCompareFunc`` is exported from 0.53.4 on; ``CompareFunc.simple`` exists everywhere but warns in 0.53:
  :func:`simple_compare_func`.
* ``OutputCompareResult``'s constructor changed (``passed`` first in 0.49, a stored/derived verdict in 0.53);
  its metric attributes and ``bool()`` did not: :func:`output_figures`.
* ``Comparator.run`` gained ``streaming``/``save_outputs_path``/... in 0.53.4: :func:`run_comparator` passes
  only keyword arguments every version knows.

Polygraphy is imported inside the functions (it is a heavy import and optional for the rest of the package).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import RuntimeMissingError

METRICS = ("max_absdiff", "max_reldiff", "mean_absdiff", "mean_reldiff", "median_absdiff", "median_reldiff")


def polygraphy_version() -> str:
    """The installed Polygraphy version.

    Raises:
        RuntimeMissingError: Polygraphy is not installed.
    """
    try:
        import polygraphy
    except ImportError as exc:
        raise RuntimeMissingError("validation needs Polygraphy (pip install polygraphy)") from exc
    return polygraphy.__version__


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """Silence Polygraphy's logger for the duration (it logs every iteration at INFO and every mismatch at ERROR)."""
    if not enabled:
        yield
        return
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.CRITICAL + 1):  # critical() still raises; its message is in the exception
        yield


def simple_compare_func(atol: Mapping[str, float], rtol: Mapping[str, float],
                        check_error_stat: str | Mapping[str, str] = "elemwise"):
    """Polygraphy's simple compare function with per-output tolerances (``""`` is the default key).

    Args:
        atol, rtol: ``{output name: tolerance}``.
        check_error_stat: ``elemwise`` (an element fails when it exceeds both atol and rtol), ``max``, ``mean``,
            ``median`` or ``quantile``; or a dict per output.
    """
    kwargs = dict(atol=dict(atol), rtol=dict(rtol), check_error_stat=check_error_stat, check_shapes=True)
    try:
        from polygraphy.comparator import SimpleCompareFunc  # 0.53.4+
    except ImportError:
        SimpleCompareFunc = None
    if SimpleCompareFunc is not None:
        return SimpleCompareFunc(**kwargs)
    from polygraphy.comparator import CompareFunc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return CompareFunc.simple(**kwargs)


def run_comparator(runners: Sequence, data_loader: Iterable, save_inputs_path: str | None = None):
    """``Comparator.run`` sequentially (each runner over the whole trajectory in turn), on any version.

    Returns: Polygraphy ``RunResults``.
    """
    from polygraphy.comparator import Comparator

    kwargs: dict[str, Any] = {"data_loader": data_loader}
    if save_inputs_path is not None:
        kwargs["save_inputs_path"] = save_inputs_path
    return Comparator.run(list(runners), **kwargs)


def compare(run_results, comparisons: Sequence[tuple[int, int]], compare_func):
    """``Comparator.compare_accuracy`` reduced to one ``AccuracyResult`` (see :func:`first_accuracy_result`)."""
    from polygraphy.comparator import Comparator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        acc = Comparator.compare_accuracy(run_results, comparisons=list(comparisons), compare_func=compare_func)
    return first_accuracy_result(acc)


def first_accuracy_result(acc):
    """The ``AccuracyResult`` of the first compare function, from either API generation.

    0.53.4+: ``AccuracyResults`` (a list of ``AccuracyResult``); 0.49/0.50: the ``AccuracyResult`` itself.
    """
    if type(acc).__name__ == "AccuracyResults" or (isinstance(acc, list) and not hasattr(acc, "stats")):
        if len(acc) == 0:
            raise ValueError("Polygraphy returned no accuracy result")
        return acc[0]
    return acc


def pair_results(acc_result, pair: tuple[str, str]) -> list[dict[str, Any]]:
    """Per iteration, ``{output: OutputCompareResult}`` of one runner pair of an ``AccuracyResult``."""
    if pair not in acc_result:
        raise KeyError(f"no comparison of {pair[0]} with {pair[1]} in the accuracy result "
                       f"(pairs: {list(acc_result.keys())})")
    return [dict(iteration) for iteration in acc_result[pair]]


def output_figures(result) -> dict[str, Any]:
    """An ``OutputCompareResult`` as plain data: ``passed`` and the metrics every version records."""
    out: dict[str, Any] = {"passed": bool(result)}
    for name in METRICS:
        value = getattr(result, name, None)
        out[name] = None if value is None else float(value)
    return out


def save_run_results(run_results, path: str | Path) -> None:
    """``RunResults.save`` (Polygraphy's JSON, readable by ``polygraphy run --load-outputs``)."""
    run_results.save(str(path))


def load_run_results(path: str | Path):
    """``RunResults.load``.

    Raises:
        FileNotFoundError, ValueError: the file is missing or is not Polygraphy RunResults JSON.
    """
    from polygraphy.comparator import RunResults

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no run results at {path}")
    try:
        results = RunResults.load(str(path))
    except Exception as exc:  # Polygraphy raises PolygraphyException or json errors
        raise ValueError(f"{path} is not Polygraphy RunResults JSON ({type(exc).__name__}: {exc})") from None
    if type(results).__name__ != "RunResults":
        raise ValueError(f"{path} holds a {type(results).__name__}, not RunResults")
    return results


def runner_names(run_results) -> list[str]:
    """Names of the runners in a ``RunResults``, in order."""
    return [name for name, _ in run_results.items()]


def iteration_outputs(run_results, runner: str) -> list[dict[str, Any]]:
    """Per iteration, ``{output name: array}`` of one runner (loads Polygraphy's lazy arrays)."""
    for name, iterations in run_results.items():
        if name == runner:
            return [{key: value for key, value in iteration.items()} for iteration in iterations]
    raise KeyError(f"no runner {runner!r} in the run results (runners: {runner_names(run_results)})")


def save_feed_dicts(feed_dicts: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """The trajectory's feed dicts as Polygraphy input JSON (``polygraphy run --load-inputs``)."""
    from polygraphy.json import save_json

    save_json([dict(f) for f in feed_dicts], str(path), description="mla-deploy validation inputs")


def load_feed_dicts(path: str | Path) -> list[dict[str, Any]]:
    """Feed dicts saved by :func:`save_feed_dicts`."""
    from polygraphy.json import load_json

    return [dict(f) for f in load_json(str(path), description="mla-deploy validation inputs")]
