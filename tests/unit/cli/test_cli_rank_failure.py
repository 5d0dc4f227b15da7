"""A lost rank (`RankFailure`) is one line on stderr and exit status `EXIT_RANK_FAILURE`, not an
internal error; ``--debug`` adds the traceback with the backend's text."""

from __future__ import annotations

from densetrain.cli.main import EXIT_INTERNAL_ERROR, EXIT_RANK_FAILURE, report_error
from densetrain.errors import RankFailure
from densetrain.parallel.distributed import CollectiveError


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001 (a traceback to print)
        return caught


def _failure() -> CollectiveError:
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer")
        except RuntimeError as raw:
            raise CollectiveError(
                "rank 0 of 2 failed at step 8: a collective did not complete: rank 1 of 2 "
                "(host h, pid 7) is lost: last seen at step 7, no heartbeat for 4.1 s",
                backend_error=str(raw)) from raw
    except CollectiveError as err:
        return err


def test_rank_failure_is_one_line_with_its_own_exit_status(capsys) -> None:
    assert EXIT_RANK_FAILURE not in (0, 1, 2, 3, 75, 130, 141, 143)
    assert issubclass(CollectiveError, RankFailure)
    assert report_error(_failure(), "train", debug=False) == EXIT_RANK_FAILURE
    err = capsys.readouterr().err
    assert err == ("densetrain train: error: rank 0 of 2 failed at step 8: a collective did not"
                   " complete: rank 1 of 2 (host h, pid 7) is lost: last seen at step 7, no "
                   "heartbeat for 4.1 s\n")


def test_debug_shows_the_traceback_and_the_backend_text(capsys) -> None:
    assert report_error(_failure(), "train", debug=True) == EXIT_RANK_FAILURE
    err = capsys.readouterr().err
    assert "Traceback" in err and "Connection closed by peer" in err
    assert err.rstrip().splitlines()[-1].startswith("densetrain train: error: rank 0 of 2")


def test_other_runtime_errors_stay_internal(capsys) -> None:
    error = _raised(RuntimeError("shape mismatch in the step"))
    assert report_error(error, "train", debug=False) == EXIT_INTERNAL_ERROR
    assert "internal error RuntimeError" in capsys.readouterr().err
