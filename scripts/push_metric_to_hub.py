#!/usr/bin/env python
"""Publish the LongPPL metric as a Hugging Face Space (the metric, its card and its Gradio app).

    python scripts/push_metric_to_hub.py --repo-id ORG/longppl --dry-run   # list the files, upload nothing
    python scripts/push_metric_to_hub.py --repo-id ORG/longppl             # create/update the Space

Afterwards ``evaluate.load("ORG/longppl")`` downloads the metric from the Space, and the Space runs
``app.py``. Both are thin shells over the ``longppl`` package, which the Space installs from its
``requirements.txt`` (``longppl-hf`` at this version): publish that version of the package first.
The token comes from ``--token``, else ``HF_TOKEN``, else the saved login (``hf auth login``); it
needs write access to ORG.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from longppl.commandline.running import tool_parser

METRIC_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrics", "longppl")
# owner/name, each starting with a letter or digit, of the characters the Hub allows.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


# The Space is the two thin shells over the installed package (longppl.py for evaluate.load, app.py for the page),
# the requirements that install that package, and the metric card (its YAML header configures the Space).
SPACE_FILES = ("README.md", "app.py", "longppl.py", "requirements.txt")


def space_files(folder: str = METRIC_FOLDER) -> list[str]:
    """The files of ``folder`` that the Space gets, sorted: :data:`SPACE_FILES` (the package's code
    comes from ``requirements.txt``, not from the upload); a ``ValueError`` if one is missing."""
    missing = [name for name in SPACE_FILES if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ValueError(f"{folder} lacks the Space's {', '.join(missing)}: pass the metric folder.")
    return sorted(SPACE_FILES)


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is ``owner/name`` as the Hub allows it, else a ``ValueError`` saying what to pass."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    problem = None if REPO_ID.match(repo_id) else "it is not of the form owner/name"
    if problem is None:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as err:
            problem = str(err)
    if problem:
        raise ValueError(
            f"--repo-id {repo_id!r} is not a Space id: {problem}. Pass owner/name, e.g. my-org/longppl "
            "(letters, digits, '-', '_', '.'; no '--' or '..')."
        )
    return repo_id


def resolve_token(token: str | None) -> str:
    """``token``, else ``HF_TOKEN``, else the saved login; a ``ValueError`` saying how to log in if none."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise ValueError(
            "No Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login` "
            "(the token needs write access to the Space's owner). Nothing was uploaded."
        )
    return token


def push(repo_id: str, token: str, folder: str = METRIC_FOLDER, private: bool = False) -> str:
    """Create the Space if needed (Gradio SDK) and upload exactly :func:`space_files`; return the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="space", space_sdk="gradio", exist_ok=True, private=private)
    info = api.upload_folder(
        repo_id=repo_id,
        repo_type="space",
        folder_path=folder,
        allow_patterns=space_files(folder),
        commit_message="Upload the LongPPL metric",
    )
    return str(getattr(info, "commit_url", info))


def main(argv: list[str] | None = None) -> None:
    """Command line (see the module docstring)."""
    parser = tool_parser(None, __doc__)
    parser.add_argument("--repo-id", required=True, help="the Space, owner/name (e.g. my-org/longppl; required)")
    parser.add_argument(
        "--token", help="Hugging Face token with write access (default: HF_TOKEN, then the saved login)"
    )
    parser.add_argument("--private", action="store_true", help="create the Space private (default: public)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the files that would be uploaded; upload nothing (default: upload)",
    )
    parser.add_argument("--folder", default=METRIC_FOLDER, help=argparse.SUPPRESS)  # for the tests
    args = parser.parse_args(argv)
    try:
        repo_id = check_repo_id(args.repo_id)
        files = space_files(args.folder)
        if args.dry_run:
            for name in files:
                print(name)
            return
        token = resolve_token(args.token)
    except ValueError as err:
        sys.exit(f"error: {err}")
    url = push(repo_id, token, args.folder, args.private)
    print(f"Uploaded {len(space_files(args.folder))} files to https://huggingface.co/spaces/{repo_id} ({url}).")


if __name__ == "__main__":
    main()
