"""Where builds live: content-hashed keys, the on-disk store, and the build lock."""
