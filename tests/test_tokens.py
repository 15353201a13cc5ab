"""Single-token texts stay readable when a token is only part of a UTF-8 character."""

from inspector.engine.tokens import token_text


def test_partial_characters_show_their_bytes(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    text = "x = '😀é'"
    ids = tok(text)["input_ids"]
    pieces = [token_text(tok, i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces).startswith("x = '")
    escaped = [p for p in pieces if p.startswith("\\x")]
    assert escaped[:4] == ["\\xf0", "\\x9f", "\\x98", "\\x80"]  # the emoji, byte by byte
    assert token_text(tok, tok("def")["input_ids"][0]) == "def"
