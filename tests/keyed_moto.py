"""moto_server for an endpoint that checks signatures (``MotoServer(keyed=True)``).

moto checks a request's SigV4 signature against the URL as Flask gives it, whose query has
"/" decoded (``prefix=a/``), while the client signed ``prefix=a%2F``: every listing under a
prefix would fail with SignatureDoesNotMatch. In this process only, the server side's
canonical query string is built from the decoded and re-encoded parts, as the client's is.
The signature is still the HMAC of the secret over the request: a wrong key or secret fails.
(Object names with "+" or non-ASCII letters still fail there; stoker's own names have none.)

    python -m tests.keyed_moto -H HOST -p PORT
"""

from urllib.parse import quote, unquote

from botocore import auth


def _canonical_query_string_url(self, parts) -> str:
    pairs = []
    for pair in parts.query.split("&") if parts.query else ():
        key, _, value = pair.partition("=")
        pairs.append((quote(unquote(key), safe="-_.~"), quote(unquote(value), safe="-_.~")))
    return "&".join(f"{k}={v}" for k, v in sorted(pairs))


auth.SigV4Auth._canonical_query_string_url = _canonical_query_string_url

if __name__ == "__main__":
    from moto.server import main

    main()
