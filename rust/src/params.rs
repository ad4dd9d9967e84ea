//! What an experiment varied: `GPUExperiment(..., params={"bs": 64})`, or read from a name such
//! as `bs=64` or `bs=64,lr=3e-4`. Numbers stay numbers, so experiments can be plotted against them.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, Serializer};

/// One value: a number keeps its kind (64 is an integer, 3e-4 a float).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Param {
    Int(i64),
    Float(f64),
    Bool(bool),
    Text(String),
}

impl Param {
    /// Read as people write values in a name: an integer, a float, true/false, or text.
    pub fn parse(text: &str) -> Param {
        if let Ok(int) = text.parse::<i64>() {
            return Param::Int(int);
        }
        // Rust reads "inf" and "nan" as floats too; in a name they are words.
        match text.parse::<f64>() {
            Ok(float) if float.is_finite() => return Param::Float(float),
            _ => {}
        }
        match text {
            "true" | "True" => Param::Bool(true),
            "false" | "False" => Param::Bool(false),
            _ => Param::Text(text.to_string()),
        }
    }

    /// `params={key: float}`: a finite float. JSON, where reports go, has no NaN nor infinity:
    /// stored, they would read back as null.
    pub fn finite(key: &str, float: f64) -> crate::error::Result<Param> {
        if !float.is_finite() {
            return Err(crate::error::Error::InvalidArgument(format!(
                "params={{{key:?}: {float}}}: a param must be a finite number (JSON, where reports go, \
                 has no {float}); pass it as text, e.g. params={{{key:?}: \"{float}\"}}"
            )));
        }
        Ok(Param::Float(float))
    }

    /// The value as a number, for plotting against it.
    pub fn number(&self) -> Option<f64> {
        match self {
            Param::Int(int) => Some(*int as f64),
            Param::Float(float) => Some(*float),
            Param::Bool(_) | Param::Text(_) => None,
        }
    }
}

impl std::fmt::Display for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Param::Int(int) => write!(f, "{int}"),
            Param::Float(float) => write!(f, "{float}"),
            Param::Bool(flag) => write!(f, "{flag}"),
            Param::Text(text) => f.write_str(text),
        }
    }
}

/// Named values in the order they were given; JSON shows them as an object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Params(pub Vec<(String, Param)>);

impl Params {
    /// The `key=value` pieces of a name, split at commas, semicolons and spaces: `bs=64`,
    /// `bs=64,lr=3e-4`, `resnet bs=64`. Pieces without `=` are the name's words, not params.
    pub fn from_name(name: &str) -> Params {
        let mut params = Params::default();
        for piece in name.split([',', ';', ' ', '\t']) {
            let Some((key, value)) = piece.split_once('=') else { continue };
            let (key, value) = (key.trim(), value.trim());
            let is_key = key.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
                && key.chars().all(|c| c.is_alphanumeric() || "_.-".contains(c));
            if is_key && !value.is_empty() {
                params.set(key, Param::parse(value));
            }
        }
        params
    }

    /// Sets `key`, keeping its place when it was already there.
    pub fn set(&mut self, key: &str, value: Param) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some((_, slot)) => *slot = value,
            None => self.0.push((key.to_string(), value)),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Param> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `bs=64, lr=0.0003`, as a table shows them.
    pub fn label(&self) -> String {
        self.0.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
    }
}

impl Serialize for Params {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// Read back from a report's JSON, in the order written.
impl<'de> Deserialize<'de> for Params {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Params, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = Params;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of params")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Params, M::Error> {
                let mut params = Params::default();
                while let Some((key, value)) = map.next_entry::<String, Param>()? {
                    params.set(&key, value);
                }
                Ok(params)
            }
        }
        deserializer.deserialize_map(InOrder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_float_param_is_finite_or_refused_with_the_fix() {
        assert_eq!(Param::finite("lr", 3e-4), Ok(Param::Float(3e-4)));
        let Err(crate::error::Error::InvalidArgument(message)) = Param::finite("lr", f64::INFINITY) else {
            panic!("infinity passed")
        };
        assert_eq!(
            message,
            "params={\"lr\": inf}: a param must be a finite number (JSON, where reports go, has no inf); \
             pass it as text, e.g. params={\"lr\": \"inf\"}"
        );
        assert!(Param::finite("lr", f64::NAN).is_err());
    }

    fn json(params: &Params) -> String {
        serde_json::to_string(params).unwrap()
    }

    #[test]
    fn names_give_their_key_value_pieces_and_numbers_stay_numbers() {
        assert_eq!(json(&Params::from_name("bs=64")), r#"{"bs":64}"#);
        assert_eq!(json(&Params::from_name("bs=64,lr=3e-4")), r#"{"bs":64,"lr":0.0003}"#);
        assert_eq!(
            json(&Params::from_name("resnet50 bs=128; amp=true opt=adam")),
            r#"{"bs":128,"amp":true,"opt":"adam"}"#
        );
        assert_eq!(json(&Params::from_name("lr=1.5, wd=0")), r#"{"lr":1.5,"wd":0}"#);
    }

    #[test]
    fn a_name_without_pieces_has_no_params() {
        for name in ["exp-1", "baseline", "a=", "=3", "1x=2"] {
            assert!(Params::from_name(name).is_empty(), "{name}");
        }
        assert_eq!(Params::from_name("x=nan").get("x"), Some(&Param::Text("nan".into())), "nan is a word");
    }

    #[test]
    fn json_reads_back_the_same_params_in_the_same_order() {
        let params = Params::from_name("opt=adam,bs=64,lr=3e-4,amp=false");
        let back: Params = serde_json::from_str(&json(&params)).unwrap();
        assert_eq!(back, params);
        assert_eq!(back.get("bs"), Some(&Param::Int(64)));
    }

    #[test]
    fn order_is_kept_and_a_repeated_key_keeps_its_place() {
        let params = Params::from_name("lr=1,bs=2,lr=3");
        assert_eq!(params.label(), "lr=3, bs=2");
        assert_eq!(params.get("bs").and_then(Param::number), Some(2.0));
        assert_eq!(Param::Text("adam".into()).number(), None);
    }
}
