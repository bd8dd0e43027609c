"""``ragserve loadtest``: the headless load test of :mod:`loadtests.runner` (a source checkout)."""

from __future__ import annotations

import argparse

from ragserve.cli import Subparsers


def add_parser(subparsers: Subparsers, name: str) -> None:
    # NOTE: imported here so that a checkout without loadtests/ (or without locust) only
    # loses this command; ragserve.cli turns the ImportError into a clear message.
    from loadtests.runner import add_arguments

    parser = subparsers.add_parser(
        name,
        help="load-test a server on loopback with locust and write a report",
        description="Start a server (or target --host on loopback), run locust headless, "
        "check the server's health after the load, and write a report folder.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadtests.runner import run_checked

    return run_checked(args)
