"""The console's pure rules, without a server: what a shown text keeps of a credential, the
sign-in limit's buckets on a clock of the test's own, the host names it answers to, the
bidirectional controls a shown text loses, and the named users of a users file."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mongo_outbox.cli.console.auth import (
    TOKEN_USER,
    Credentials,
    CredentialsError,
    Hashed,
    Role,
    User,
    hash_secret,
    read_users,
)
from mongo_outbox.cli.console.bidi import CONTROLS, visible
from mongo_outbox.cli.console.hosts import allowed_hosts, is_loopback, name_of
from mongo_outbox.cli.console.limits import Rate, SignInLimit, client_key
from mongo_outbox.cli.console.redaction import redact_text, redacted
from mongo_outbox.errors import ConfigurationError


def test_every_url_in_a_text_loses_its_credentials() -> None:
    text = "failed: error.mongodb://u:pw1@h/x, then foo=redis://:pw2@r:6379 and nats://tok3@n"
    shown = redact_text(text)
    assert shown == (
        "failed: error.mongodb://u:***@h/x, then foo=redis://:***@r:6379 and nats://***@n"
    )
    assert redact_text("the token-is-here was refused", ["token-is-here"]) == (
        "the *** was refused"
    )


def test_data_is_redacted_through_and_keeps_its_numbers_and_keys() -> None:
    data = {"password": ["mongodb://a:b@c"], "n": 3, "none": None, "ok": True}
    assert redacted(data) == {"password": ["mongodb://a:***@c"], "n": 3, "none": None, "ok": True}


def test_a_long_word_is_redacted_in_linear_time() -> None:
    # Tried from every letter, the URL pattern took seconds for 50,000 letters (the square).
    started = time.perf_counter()
    redact_text("a" * 200_000)
    redact_text("a." * 100_000)
    assert time.perf_counter() - started < 2


class Clock:
    """A FAKE clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_client_gets_its_burst_then_one_guess_per_interval() -> None:
    clock = Clock()
    limit = SignInLimit(Rate(burst=2, every=10), Rate(burst=100, every=1), clock)
    assert [limit.take("10.0.0.1") for _ in range(3)] == [0, 0, pytest.approx(10)]
    assert limit.take("10.0.0.2") == 0  # another client
    clock.now += 5
    assert limit.take("10.0.0.1") == pytest.approx(5)
    clock.now += 5
    assert limit.take("10.0.0.1") == 0


def test_the_overall_limit_holds_whatever_the_address() -> None:
    clock = Clock()
    limit = SignInLimit(Rate(burst=5, every=10), Rate(burst=3, every=2), clock)
    assert [limit.take(f"10.0.0.{n}") for n in range(4)] == [0, 0, 0, pytest.approx(2)]
    clock.now += 2
    assert limit.take("10.0.0.9") == 0


def test_a_full_bucket_is_forgotten_and_ipv6_counts_by_its_64() -> None:
    clock = Clock()
    limit = SignInLimit(Rate(burst=1, every=10), Rate(burst=100, every=1), clock)
    assert limit.take("2001:db8::1") == 0
    assert limit.take("2001:db8::ffff") > 0  # the same /64
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"
    clock.now += 10
    limit.take("10.0.0.1")
    assert set(limit.clients) == {"10.0.0.1"}


def test_the_host_names_answered_to() -> None:
    assert name_of("[::1]:8600") == "::1" and name_of("Console.Example.:443") == "console.example"
    assert name_of("[::1") is None
    assert allowed_hosts("0.0.0.0") == {"localhost", "127.0.0.1", "::1"}
    assert "10.1.2.3" in allowed_hosts("10.1.2.3")
    assert "proxy.example" in allowed_hosts("::", ["proxy.example:443"])
    with pytest.raises(ConfigurationError, match="not a host name"):
        allowed_hosts("127.0.0.1", ["[bad"])
    assert is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


# -- what is shown: bidirectional controls ------------------------------------------------------


@given(st.text(alphabet=st.sampled_from([*CONTROLS, "a", "\u05d0", ".", "u", "\u200b"])))
def test_a_shown_text_keeps_no_bidi_control_and_changes_nothing_else(text: str) -> None:
    shown = visible(text)
    assert not set(shown) & set(CONTROLS)
    # Each control became its escape, every other character stayed where it was: undoing the
    # escapes gives the text back.
    undone = re.sub(r"\\u([0-9a-f]{4})", lambda m: chr(int(m[1], 16)), shown)
    assert undone == text


def test_a_right_to_left_override_is_shown_as_its_escape() -> None:
    assert visible("t.\u202egnp.exe") == "t.\\u202egnp.exe"
    assert visible("\u2067x\u2069") == "\\u2067x\\u2069"
    assert visible("שלום order.paid") == "שלום order.paid"  # letters are no control


# -- named users --------------------------------------------------------------------------------

SECRET = "a-secret-of-the-tests"


def test_a_users_file_signs_in_each_user_with_its_own_secret_and_role() -> None:
    users = read_users(
        [
            "# who may sign in",
            f"alice:operator:{hash_secret(SECRET)}",
            "",
            f"bob:reader:{hash_secret(SECRET + '-bob')}",
        ]
    )
    both = Credentials(token="a-shared-token-0123", users=users)
    assert both.configured and both.named_login
    assert both.accept("", "alice", SECRET) == User("alice", Role.OPERATOR)
    assert both.accept("", "bob", SECRET + "-bob") == User("bob", Role.READER)
    assert both.accept("", "bob", SECRET) is None  # alice's secret is not bob's
    assert both.accept("", "carol", SECRET) is None
    assert both.accept("a-shared-token-0123", "", "") == User(TOKEN_USER, Role.OPERATOR)
    assert not User("bob", Role.READER).may_act and User("alice", Role.OPERATOR).may_act


def test_a_hash_is_salted_and_only_its_secret_matches_it() -> None:
    one, two = hash_secret(SECRET), hash_secret(SECRET)
    assert one != two and one.startswith("scrypt$16384$8$1$")
    assert Hashed.parse(one).matches(SECRET) and not Hashed.parse(one).matches(SECRET + "x")
    assert str(Hashed.parse(one)) == one
    with pytest.raises(CredentialsError, match="at least 12"):
        hash_secret("short")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("alice:admin:{h}", "line 2: the role must be reader or operator, not 'admin'"),
        ("alice:operator", "line 2: a line reads name:role:hash"),
        (":operator:{h}", "line 2: a line reads name:role:hash"),
        ("alice:operator:md5$abc", "line 2: the hash must read scrypt$n$r$p$salt$hash"),
        ("alice:reader:scrypt$1048577$8$1$AAAAAAAAAAAAAAAAAAAAAA$" + "A" * 43, "out of bounds"),
        ("alice:reader:scrypt$1048576$8$1$AAAAAAAAAAAAAAAAAAAAAA$" + "A" * 43, "256 MiB"),
        ("ops:reader:{h}", "line 2: 'ops' is named twice"),
    ],
)
def test_a_malformed_users_file_names_its_line(line: str, says: str) -> None:
    hashed = hash_secret(SECRET)
    with pytest.raises(CredentialsError, match=re.escape(says)):
        read_users([f"ops:operator:{hashed}", line.format(h=hashed)])


def test_a_users_file_and_the_environment_do_not_name_one_user_twice(tmp_path: Path) -> None:
    listed = tmp_path / "users"
    listed.write_text(f"ops:operator:{hash_secret(SECRET)}\n")
    env = {"MONGO_OUTBOX_CONSOLE_USER": "ops", "MONGO_OUTBOX_CONSOLE_PASSWORD": SECRET}
    with pytest.raises(CredentialsError, match="'ops' signs in from the environment already"):
        Credentials.from_env(env, listed)
    with pytest.raises(CredentialsError, match="cannot read"):
        Credentials.from_env({}, tmp_path / "missing")
    assert Credentials.from_env({}, listed).users["ops"][0] == User("ops", Role.OPERATOR)


def test_newuser_prints_a_users_file_line_from_the_secret_on_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mongo_outbox.cli.console.newuser import main

    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\n"))
    assert main(["alice", "operator"]) == 0
    line = capsys.readouterr().out.strip()
    users = read_users([line])
    assert users["alice"][0] == User("alice", Role.OPERATOR)
    assert users["alice"][1].matches(SECRET)
    assert main(["alice", "admin"]) == 2 and "usage" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["bob", "reader"]) == 1 and "at least 12" in capsys.readouterr().err
