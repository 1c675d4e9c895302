//! `cache_control`: see `tollgate_gateway::fuzz::cache_control`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::cache_control(data));
