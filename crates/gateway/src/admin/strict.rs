//! JSON read for the admin API: as `serde_json`'s value, except that an object naming a
//! field twice is refused. Taking the last silently would apply a change its sender may
//! not have meant (`{"plan": "gold", "plan": null}`).

use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;

/// Parses `bytes` as JSON whose objects name each field once.
pub(super) fn parse(bytes: &[u8]) -> serde_json::Result<Value> {
    serde_json::from_slice::<Strict>(bytes).map(|s| s.0)
}

struct Strict(Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Values).map(Strict)
    }
}

struct Values;

impl<'de> Visitor<'de> for Values {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(A::Error::custom(format!("field {k:?} is given twice")));
            }
            let Strict(v) = map.next_value()?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_given_twice_is_refused_at_any_depth_and_the_rest_reads_as_serde_json() {
        for text in [
            r#"{"plan": "gold", "key_sha256": ["a", 1, 2.5, -3, null, true], "metadata": {"x": {"y": []}}}"#,
            "[]",
            r#""text""#,
            "18446744073709551615",
        ] {
            let want: Value = serde_json::from_str(text).expect("json");
            assert_eq!(parse(text.as_bytes()).expect(text), want);
        }
        for text in [
            r#"{"plan": "gold", "plan": null}"#,
            r#"{"metadata": {"a": 1, "a": 2}}"#,
            r#"[{"k": 1, "k": 1}]"#,
        ] {
            let e = parse(text.as_bytes()).expect_err(text).to_string();
            assert!(e.contains("is given twice"), "{e}");
        }
        assert!(parse(b"{\"a\":").is_err());
    }
}
