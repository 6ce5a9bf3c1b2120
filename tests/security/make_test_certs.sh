#!/bin/sh
# Makes the certificates the security tests use, with the openssl command-line tool, into DIR:
#   ca.pem ca.key          a test CA
#   server.pem server.key  signed by it, for 127.0.0.1 and localhost
#   client.pem client.key  signed by it, a client certificate (mutual TLS)
#   rogue.pem rogue.key    a self-signed client certificate no server trusts
# Usage: make_test_certs.sh DIR. P-256 keys: quick to make. Valid for two days.
set -eu
dir=$1
mkdir -p "$dir"
cd "$dir"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -out ca.pem -days 2 -subj "/CN=indexer test CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"

sign() {  # sign NAME SUBJECT EXTENSIONS
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "$2"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" \
    -days 2 -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
sign server "/CN=localhost" "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
sign client "/CN=indexer test client" "extendedKeyUsage=clientAuth"

key rogue.key
openssl req -x509 -new -key rogue.key -out rogue.pem -days 2 -subj "/CN=rogue client" \
  -addext "extendedKeyUsage=clientAuth"
