"""Four short Konkani sentences: the text of the tests' small tokenizer (conftest's ``tokenizer``)
and of the rows they write by hand."""

TEXTS = ["हांव घरा वता", "तूं कितें करता", "आमी पणजेक गेलें", "ताणें जेवण केलें"]
