def test(): pass
