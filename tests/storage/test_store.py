"""One storage-protocol test class, run against memory://, a temp dir and a real S3 endpoint."""

import uuid

import pytest

from stoker.storage.store import Store


@pytest.fixture(params=["memory", "local", "s3"])
def store(request, tmp_path):
    if request.param == "memory":
        return Store(f"memory://stoker-{uuid.uuid4().hex[:8]}")
    if request.param == "local":
        return Store(str(tmp_path / "root"))  # a bare path becomes file://
    root, options = request.getfixturevalue("s3_root")
    return Store(root, options)


class TestStoreProtocol:
    def test_write_read_exists_size(self, store):
        store.write_bytes("a/b.bin", b"12345")
        assert store.exists("a/b.bin") and not store.exists("a/c.bin")
        assert store.read_bytes("a/b.bin") == b"12345" and store.size("a/b.bin") == 5

    def test_json_and_append(self, store):
        store.write_json("m.json", {"x": [1, 2]})
        assert store.read_json("m.json") == {"x": [1, 2]}
        store.append_text("log.jsonl", "1\n")
        store.append_text("log.jsonl", "2\n")
        assert store.read_bytes("log.jsonl") == b"1\n2\n"

    def test_listing_and_walk(self, store):
        for key in ("d/x/1", "d/x/2", "d/y"):
            store.write_bytes(key, b"ab")
        assert store.listdir("d") == ["x", "y"]
        assert store.walk_files("d") == {"x/1": 2, "x/2": 2, "y": 2}
        assert store.listdir("missing") == [] and store.walk_files("missing") == {}

    def test_copy_rename_rm(self, store):
        store.write_bytes("src/f", b"data")
        store.copy("src/f", "dst/f")
        store.rename("src", "moved")
        assert store.read_bytes("moved/f") == b"data" == store.read_bytes("dst/f")
        assert not store.exists("src/f")
        store.rm("moved")
        assert not store.exists("moved/f")

    def test_range_read(self, store):
        store.write_bytes("r.bin", bytes(range(100)))
        assert store.read_range("r.bin", 10, 5) == bytes(range(10, 15))
        assert store.read_range("r.bin", 90, 10) == bytes(range(90, 100))
        assert store.read_range("r.bin", 3, 0) == b""

    def test_put_get_and_checksum(self, store, tmp_path):
        local = tmp_path / "in.bin"
        local.write_bytes(b"x" * 1000)
        store.put_file(str(local), "up/in.bin")
        store.get_file("up/in.bin", str(tmp_path / "out" / "in.bin"))
        assert (tmp_path / "out" / "in.bin").read_bytes() == b"x" * 1000
        import hashlib

        assert store.sha256("up/in.bin") == hashlib.sha256(b"x" * 1000).hexdigest()

    def test_urls_keep_the_scheme(self, store):
        url = store.url("runs", "r1", "config.json")
        assert url.startswith(store.root + "/") and "://" in url
        store.write_bytes(url, b"{}")  # a full URL under the root works as a key
        assert store.exists("runs/r1/config.json")


@pytest.mark.parametrize(
    "key",
    ["runs/../../etc/passwd", "../outside", "runs/./x", "runs\\..\\x", "file:///etc/passwd", "s3://other-bucket/x"],
)
def test_a_key_can_never_leave_the_store_root(tmp_path, key):
    store = Store("file://" + str(tmp_path / "root"))
    with pytest.raises(ValueError, match="store root"):
        store.write_bytes(key, b"x")
    assert not (tmp_path / "outside").exists()
