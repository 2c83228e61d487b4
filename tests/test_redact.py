"""One redaction: free text and configured URLs share the rules; only the URL keeps a user name."""

from __future__ import annotations

from servetune.redact import MASK, redact, redact_text, redact_url

ENV = {"HF_TOKEN": "hf_abcdefgh1234", "PATH": "/usr/bin"}


def test_free_text_loses_the_whole_user_info_and_secret_query_parameters() -> None:
    assert redact_text("https://bob:pw@h/x?token=abc&n=1", environ={}) == f"https://{MASK}@h/x?token={MASK}&n=1"
    assert redact_text("uses hf_abcdefgh1234 from the env", environ=ENV) == f"uses {MASK} from the env"


def test_a_configured_url_keeps_its_user_and_loses_every_secret() -> None:
    assert redact_url("postgresql://optuna:s3cr3t@db:5432/optuna", environ={}) == f"postgresql://optuna:{MASK}@db:5432/optuna"
    assert redact_url("https://h/?api_key=k&x=1", environ={}) == f"https://h/?api_key={MASK}&x=1"
    assert redact_url("https://u:p@h/hf_abcdefgh1234", environ=ENV) == f"https://u:{MASK}@h/{MASK}"
    assert redact_url("sqlite:////tmp/x.db", environ={}) == "sqlite:////tmp/x.db"


def test_mappings_mask_secret_keys_and_secrets_inside_values() -> None:
    assert redact({"db_password": "x", "notes": "see https://a:b@h/", "n": 3}, environ={}) == {
        "db_password": MASK, "notes": f"see https://{MASK}@h/", "n": 3}
