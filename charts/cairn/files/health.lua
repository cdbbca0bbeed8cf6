-- Argo CD resource health check for cairn.dev/TrainingJob.
-- Install: resource.customizations.health.cairn.dev_TrainingJob in argocd-cm
-- (docs/gitops.md). Argo CD sets the global `obj` to the live object.
--
--   no status yet, or status.observedGeneration < metadata.generation -> Progressing
--   Pending, Starting, Running, Restarting, Suspending                  -> Progressing
--   Succeeded                                                           -> Healthy
--   Failed                                                              -> Degraded
--   Suspended                                                           -> Suspended
--   anything else                                                       -> Unknown
--
-- The message is the matching condition's message (Ready, Reconciling,
-- Complete, Failed, Suspended), so the UI shows what the operator says.

local hs = {}

local function condition(status, kind)
  if status == nil or status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function message_of(status, kinds, fallback)
  for _, kind in ipairs(kinds) do
    local c = condition(status, kind)
    if c ~= nil and c.status == "True" and c.message ~= nil and c.message ~= "" then
      return c.message
    end
  end
  return fallback
end

local status = obj.status
local generation = 0
if obj.metadata ~= nil and obj.metadata.generation ~= nil then
  generation = obj.metadata.generation
end

if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Cairn operator to observe the job"
  return hs
end

if status.observedGeneration == nil or status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local phase = status.phase
local progressing = {
  Pending = true,
  Starting = true,
  Running = true,
  Restarting = true,
  Suspending = true,
}

if progressing[phase] then
  hs.status = "Progressing"
  hs.message = message_of(status, { "Ready", "Reconciling" }, phase)
  local stale = condition(status, "CheckpointStale")
  if stale ~= nil and stale.status == "True" and stale.message ~= nil then
    hs.message = hs.message .. " (" .. stale.message .. ")"
  end
elseif phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message_of(status, { "Complete" }, "Succeeded")
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message_of(status, { "Failed", "Stalled" }, "Failed")
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = message_of(status, { "Suspended" }, "Suspended")
else
  hs.status = "Unknown"
  hs.message = "Unknown phase " .. tostring(phase)
end
return hs
