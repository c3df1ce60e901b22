"""What the command line shares, without a server: times as operators write them, durations as
they read them, credentials that never get out, and the installed entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from mongo_outbox.cli.common import Failure, age, hide, moment, scrub, table
from mongo_outbox.events import utc_now


@pytest.mark.parametrize(
    ("text", "back"),
    [("90s", 90), ("15m", 900), ("2h", 7200), ("7d", 604800), ("1h30m", 5400), ("1.5h", 5400)],
)
def test_a_span_means_that_long_ago(text: str, back: float) -> None:
    assert abs((utc_now() - moment(text, "--since")).total_seconds() - back) < 5


@pytest.mark.parametrize(
    ("text", "at"),
    [
        ("2024-05-01", datetime(2024, 5, 1, tzinfo=timezone.utc)),
        ("2024-05-01T12:30:00Z", datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)),
        ("2024-05-01T14:30:00+02:00", datetime(2024, 5, 1, 12, 30, tzinfo=timezone.utc)),
    ],
)
def test_an_iso_time_is_utc_unless_it_says_otherwise(text: str, at: datetime) -> None:
    assert moment(text, "--since") == at


@pytest.mark.parametrize("text", ["yesterday", "3x", "", "h", "5 m"])
def test_a_time_that_cannot_be_read_names_its_option(text: str) -> None:
    with pytest.raises(Failure, match="--since"):
        moment(text, "--since")


def test_durations_read_as_an_operator_writes_them() -> None:
    assert [age(timedelta(seconds=s)) for s in (0.42, 192, 18120, 183600)] == [
        "0.4s",
        "3m12s",
        "5h02m",
        "2d03h",
    ]
    assert age(None) == "-"


def test_every_credential_given_is_hidden_wherever_it_appears() -> None:
    shown = hide("mongodb://app:p%40ss-w0rd!@db1,db2/shop?replicaSet=rs0")
    assert shown == "mongodb://app:***@db1,db2/shop?replicaSet=rs0"
    hide("nats://s3cr3t-token@n1:4222,nats://u:an0ther-pw@n2:4222")
    leaked = "auth failed for p@ss-w0rd! and p%40ss-w0rd! on n1 (s3cr3t-token) n2 an0ther-pw"
    assert scrub(leaked) == "auth failed for *** and *** on n1 (***) n2 ***"


def test_a_table_aligns_its_columns() -> None:
    assert table(["A", "LONGER"], [["x", None], ["yyy", 3]], "") == "A    LONGER\nx    -\nyyy  3"


def test_the_installed_entry_point_runs_the_command_line() -> None:
    script = Path(sys.executable).parent / "mongo-outbox"
    if not script.exists():
        pytest.skip("mongo-outbox is not installed beside this interpreter")
    ran = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    assert ran.returncode == 0
    for command in ("relay", "status", "parked", "inbox", "replay", "ensure-indexes"):
        assert command in ran.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONGO_OUTBOX_")}
    missing = subprocess.run(
        [str(script), "status"], capture_output=True, text=True, check=False, env=env
    )
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        "mongo-outbox: Missing option '--uri' (env var: 'MONGO_OUTBOX_URI'). "
        "(see 'mongo-outbox status --help')"
    ]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "mongodb://app:pw0rd@db1,db2/shop?replicaSet=rs0&tls=true"
            "&tlsCertificateKeyFilePassword=k3y-pass&authMechanism=MONGODB-AWS"
            "&authMechanismProperties=SERVICE_NAME:x,AWS_SESSION_TOKEN:t0ken",
            "mongodb://app:***@db1,db2/shop?replicaSet=rs0&tls=true"
            "&tlsCertificateKeyFilePassword=***&authMechanism=MONGODB-AWS"
            "&authMechanismProperties=***",
        ),
        (
            "redis://:r3dis-pw@cache:6379/0?password=an0ther",
            "redis://:***@cache:6379/0?password=***",
        ),
        (
            "rediss://cache?ssl_keyfile=/k&ssl_password=s5l-pw",
            "rediss://cache?ssl_keyfile=/k&ssl_password=***",
        ),
        (
            "amqps://relay:mq-pw@mq/shop?certfile=/c&password=pem-pw",
            "amqps://relay:***@mq/shop?certfile=/c&password=***",
        ),
        ("nats://t0ken@n1:4222,nats://u:pw@n2:4222", "nats://***@n1:4222,nats://u:***@n2:4222"),
    ],
)
def test_every_credential_of_a_url_is_redacted_in_its_userinfo_and_query(
    url: str, shown: str
) -> None:
    assert hide(url) == shown
    secrets = ("pw0rd", "k3y-pass", "t0ken", "r3dis-pw", "an0ther", "s5l-pw", "mq-pw", "pem-pw")
    given = [s for s in secrets if s in url]
    leaked = f"the client said: {url} / {', '.join(given)}"
    assert given and not [s for s in given if s in scrub(leaked)]


def test_only_credentials_are_hidden_so_other_text_is_not_garbled() -> None:
    shown = hide(
        "mongodb://db/?authMechanism=GSSAPI&authMechanismProperties=SERVICE_NAME:mongodb,"
        "AWS_SESSION_TOKEN:t0k3n-value&passive=true&heartbeat=30"
    )
    assert shown.endswith("authMechanismProperties=***&passive=true&heartbeat=30")
    text = "mongodb://db2 answered true after 30 s; token t0k3n-value"
    assert scrub(text) == "mongodb://db2 answered true after 30 s; token ***"
