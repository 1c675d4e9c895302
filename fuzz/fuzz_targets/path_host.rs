//! `path_host`: see `tollgate_gateway::fuzz::path_host`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::path_host(data));
