#!/bin/sh
# Build the ns-3 reference program (tcp_reference.cc) against Debian's ns-3 3.37:
#   apt-get install -y libns3-dev
#   bench/ns3/build.sh OUTPUT      # e.g. ~/.cache/fedemu/ns3/tcp_reference
# Only -l flags: Debian's .pc files also name static paths (libgsl.so) that the shared
# ns-3 libraries pull in themselves.
set -eu
here=$(dirname "$0")
out=${1:?usage: build.sh OUTPUT}
pkg-config --exists ns3-internet || { echo "ns-3 not found: apt-get install -y libns3-dev" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
g++ -O2 -std=c++17 -o "$out.tmp" "$here/tcp_reference.cc" \
    $(pkg-config --libs-only-l ns3-internet ns3-point-to-point ns3-applications ns3-traffic-control)
mv "$out.tmp" "$out"
