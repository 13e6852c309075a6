from typing_extensions import Buffer

BACKEND: str
OPENSSL_VERSION: str

def chain_sha256(root: bytes, data: Buffer, page_bytes: int) -> bytes: ...
def keys_sha256(root: bytes, data: Buffer, page_bytes: int) -> list[bytes]: ...
