

def test_any_byte_range_of_an_assembled_get_is_the_same_bytes(tmp_path):
    """Ranges cut text spans, base64 spans (inside a quantum too) and inline pieces alike."""
    import random

    from webapp.filebody import B64Span, read_pieces, slice_pieces

    with jc.fixed_clock():
        core = jc.core_on(str(tmp_path))
        sids = jc.play(core, turns=3)
    pieces = core.get_session(sids[0]).body
    assert any(isinstance(p, B64Span) for p in pieces)
    whole = read_pieces(pieces)
    assert whole == expected_prefix_free(core, sids[0])
    rng = random.Random(7)
    for _ in range(300):
        a = rng.randrange(len(whole))
        b = rng.randrange(a, len(whole) + 1)
        assert read_pieces(slice_pieces(pieces, a, b)) == whole[a:b], (a, b)


def expected_prefix_free(core, sid: str) -> bytes:
    """The GET as one read (the reply's own ``read``), to compare the pieces' bytes against."""
    return core.get_session(sid).read()
