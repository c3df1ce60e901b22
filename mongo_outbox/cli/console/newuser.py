"""``python -m mongo_outbox.cli.console.newuser NAME ROLE``: the line of a console users file
(``--users-file``) for NAME, its secret read from the terminal (or stdin), so that the secret
shows in no ``ps`` and no shell history, and only its hash is written anywhere."""

from __future__ import annotations

import getpass
import sys

from mongo_outbox.cli.console.auth import CredentialsError, Role, hash_secret


def main(argv: list[str]) -> int:
    roles = "|".join(r.value for r in Role)
    if len(argv) != 2 or argv[1] not in {r.value for r in Role} or ":" in argv[0]:
        print(f"usage: python -m mongo_outbox.cli.console.newuser NAME {roles}", file=sys.stderr)
        return 2
    secret = getpass.getpass("secret: ") if sys.stdin.isatty() else sys.stdin.readline()
    try:
        print(f"{argv[0].strip()}:{argv[1]}:{hash_secret(secret.rstrip(chr(10)))}")
    except CredentialsError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
