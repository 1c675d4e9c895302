//! `upstream_h1`: see `tollgate_gateway::fuzz::upstream_h1`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::upstream_h1(data));
