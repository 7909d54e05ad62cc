"""The project logger writes to the stderr of the moment: a stream swapped in after set-up and closed since (pytest's
``capsys``, a caller's redirect) never receives a record, and a later record reaches the stderr in place then."""

from __future__ import annotations

import io
import logging
import sys

from distillery.common.log import LOGGER_NAME, setup_logging


def test_a_record_after_a_swapped_stderr_closed_reaches_the_current_one(capsys):
    setup_logging()
    logger = logging.getLogger(LOGGER_NAME)
    swapped = io.StringIO()
    before, sys.stderr = sys.stderr, swapped
    try:
        logger.warning("while swapped")
    finally:
        sys.stderr = before
    swapped_text = swapped.getvalue()
    swapped.close()
    logger.warning("after the swapped stream closed")
    err = capsys.readouterr().err
    assert "while swapped" in swapped_text
    assert "after the swapped stream closed" in err
    assert "Logging error" not in err
