//! VPCs as DigitalOcean's API serves them (`/v2/vpcs`): each account's default VPC per region,
//! names unique per account; neither the default VPC nor one with members can be deleted.

use super::*;

impl World {
    pub(super) fn vpc_json(v: &Vpc) -> Value {
        json!({
            "id": v.id,
            "urn": format!("do:vpc:{}", v.id),
            "name": v.name,
            "description": v.description,
            "region": v.region,
            "ip_range": v.ip_range,
            "default": v.default,
            "created_at": v.created_at,
        })
    }

    /// The VPCs `acting` sees: an account its own (its default VPC made on first use, as
    /// DigitalOcean does), the platform every account's.
    pub fn vpc_list(&self, acting: Option<Uuid>) -> Vec<Value> {
        self.vpc_page(acting, 0..usize::MAX).0
    }

    /// The VPCs the caller sees at positions `range` (fewer past the end), and how many it sees.
    pub fn vpc_page(&self, acting: Option<Uuid>, range: Range<usize>) -> (Vec<Value>, usize) {
        let mut st = self.lock();
        if acting.is_some() {
            self.ensure_default_vpc(&mut st, acting);
        }
        let seen: Vec<&Vpc> = st
            .vpcs
            .iter()
            .filter(|v| acting.is_none() || v.account == acting)
            .collect();
        page(&seen, range, |v| Self::vpc_json(v))
    }

    fn ensure_default_vpc(&self, st: &mut State, account: Option<Uuid>) {
        if !st.vpcs.iter().any(|v| v.default && v.account == account) {
            st.vpcs.push(default_vpc(&self.region, account));
        }
    }

    /// Another account's VPC is not found, as on DigitalOcean.
    pub fn vpc_get(&self, acting: Option<Uuid>, id: &str) -> Result<Value, WorldError> {
        let mut st = self.lock();
        if acting.is_some() {
            self.ensure_default_vpc(&mut st, acting);
        }
        st.vpcs
            .iter()
            .find(|v| v.id == id && (acting.is_none() || v.account == acting))
            .map(Self::vpc_json)
            .ok_or(WorldError::NotFound)
    }

    /// A VPC of `acting` (the platform's own without one).
    pub fn vpc_create(&self, acting: Option<Uuid>, req: VpcCreate) -> Result<Value, WorldError> {
        if req.name.is_empty()
            || !req
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        {
            return Err(unprocessable(
                "name must contain only letters, digits, '-' and '.'",
            ));
        }
        if req.region != self.region {
            return Err(unprocessable(format!(
                "region {} is not available; this region is {}",
                req.region, self.region
            )));
        }
        if req.description.as_deref().map(str::len).unwrap_or(0) > 255 {
            return Err(unprocessable("description must be at most 255 characters"));
        }
        let mut st = self.lock();
        self.ensure_default_vpc(&mut st, acting);
        let own = |v: &&Vpc| v.account == acting;
        if st.vpcs.iter().filter(own).any(|v| v.name == req.name) {
            return Err(unprocessable(format!(
                "a VPC named {} already exists",
                req.name
            )));
        }
        let ip_range = match req.ip_range {
            Some(r) => {
                if st.vpcs.iter().filter(own).any(|v| v.ip_range == r) {
                    return Err(unprocessable(format!(
                        "ip_range {r} overlaps an existing VPC"
                    )));
                }
                r
            }
            None => format!(
                "10.{}.0.0/20",
                110 + st.vpcs.iter().filter(own).count() % 100
            ),
        };
        let vpc = Vpc {
            id: Uuid::new_v4().to_string(),
            account: acting,
            name: req.name,
            description: req.description.unwrap_or_default(),
            region: req.region,
            ip_range,
            default: false,
            created_at: now_str(),
        };
        let out = Self::vpc_json(&vpc);
        st.vpcs.push(vpc);
        Ok(out)
    }

    pub fn vpc_delete(&self, acting: Option<Uuid>, id: &str) -> Result<(), WorldError> {
        let mut st = self.lock();
        let idx = st
            .vpcs
            .iter()
            .position(|v| v.id == id && (acting.is_none() || v.account == acting))
            .ok_or(WorldError::NotFound)?;
        if st.vpcs[idx].default {
            return Err(WorldError::Conflict("cannot delete the default VPC".into()));
        }
        if st.clusters.iter().any(|c| c.vpc_uuid == id) || st.lbs.iter().any(|l| l.vpc_uuid == id) {
            return Err(WorldError::Conflict(
                "cannot delete a VPC that still has members".into(),
            ));
        }
        st.vpcs.remove(idx);
        Ok(())
    }
}
