"""Tools that make or convert data outside training: the demo corpus and its voices and
transliteration, the importers of ``konkanivani-prepare``, a noisy copy of a manifest, and how they
write outputs safely (``outputs``)."""
