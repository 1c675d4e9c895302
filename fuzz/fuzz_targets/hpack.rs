//! `hpack`: see `tollgate_gateway::fuzz::hpack`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::hpack(data));
