"""extract-emails: unique lower-case addresses, sorted."""

from pathlib import Path

EXPECTED = [
    "alice.moreau@example.com",
    "billing_team@help.example.com",
    "bob.smith@work-mail.example.org",
    "bob@example.org",
    "chen.wei+news@mail.example.net",
    "support@help.example.com",
]


def test_emails():
    lines = [ln.strip() for ln in Path("/app/emails.txt").read_text().splitlines() if ln.strip()]
    assert lines == EXPECTED
